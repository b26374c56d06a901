def register(app, **serving_args):
    pass
