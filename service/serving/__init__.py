"""The serving tier: worker processes running the engine, their adapter loaders, and the router."""
