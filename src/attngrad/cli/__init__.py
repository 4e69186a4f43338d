"""The `attngrad` command line."""
