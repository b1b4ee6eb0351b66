"""asgi_generate.server"""
