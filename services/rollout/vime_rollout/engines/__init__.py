"""Engines: planning, commands, launchers, the group with its memory fan-out, the health monitor."""
