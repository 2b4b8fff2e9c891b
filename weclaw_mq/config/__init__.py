"""Settings sources: environment variables, Redis URLs, TLS options."""
