"""The local launcher behind ``vime up`` / ``vime train``: plan the stack from the run config,
start the services as supervised children in dependency order, show their logs, and tear
everything down (grandchildren included) on Ctrl-C, SIGTERM or a child's failure.
"""
