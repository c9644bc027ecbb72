"""Recipes: training loops a user could write, on the public SDK only (`inkwell.recipes.rl`: GRPO)."""
