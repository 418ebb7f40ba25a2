"""Model assets: pulling real models, writing random models of real shapes."""
