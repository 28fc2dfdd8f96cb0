"""Model definitions, their typed config, registry and weight loaders."""
