"""Connector spec files: loading, validation, hot reload."""
