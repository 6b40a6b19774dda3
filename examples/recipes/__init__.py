"""The recipes' code (docs/recipes/), each module a handler module of its own that
tests/integration/test_recipes.py runs as the pages show it."""
