"""visionflow: the library behind the pipeline's stages (params, data, models, engine, export, viz)."""
