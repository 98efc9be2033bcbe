"""Wire schemas: the JSON shapes that cross process boundaries, as pydantic models."""
