"""asgi_generate.server.hypercorn"""
