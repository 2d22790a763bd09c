"""Priority classes and admission for the embedding entry points (docs/priority-classes.md)."""
