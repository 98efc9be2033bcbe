"""Typed HTTP clients for every vime service and for the inference engines."""

from vime.clients.base import ServiceCallError, ServiceClient, ServiceUnreachable

__all__ = ["ServiceCallError", "ServiceClient", "ServiceUnreachable"]
