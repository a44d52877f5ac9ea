"""Command-line tools: thin argument layers over the library API."""
