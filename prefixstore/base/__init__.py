"""The base layer: errors, layout, keys and the structured log. Imports nothing else of the project."""
