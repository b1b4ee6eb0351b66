"""asgi_generate.ops"""
