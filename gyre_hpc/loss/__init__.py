"""Policy losses as pure torch functions."""
