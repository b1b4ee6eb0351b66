"""asgi_generate.tracing.offline"""
