"""asgi_generate.request"""
