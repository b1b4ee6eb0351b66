"""A minimal engine for asgi-generate, installed from its own distribution:
its description (:mod:`toy_engine.engine`), its generate format
(:mod:`toy_engine.codec`) and a worker speaking it (:mod:`toy_engine.worker`)."""
