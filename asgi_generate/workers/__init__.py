"""Engine workers: their HTTP client, their protocols and the router."""
