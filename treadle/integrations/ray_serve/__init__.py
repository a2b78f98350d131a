"""treadle on Ray Serve (docs/deploy.md): `build_openai_app` (app.py) returns a Ray Serve
application — an engine deployment routed by treadle's router class and an ingress
serving treadle's OpenAI routes. Importing this package imports no Ray."""


def build_openai_app(*args, **kwargs):
    from treadle.integrations.ray_serve.app import build_openai_app as build

    return build(*args, **kwargs)
