"""What a handler is: its spec, options and notification target."""
