"""Recipes: the typed schema, YAML layering, overrides and provenance."""

from tessera.config.loader import ResolvedRecipe, load_recipe, parse_override, recipe_hash, validate_recipe
from tessera.config.schema import Recipe

__all__ = ["Recipe", "ResolvedRecipe", "load_recipe", "parse_override", "recipe_hash", "validate_recipe"]
