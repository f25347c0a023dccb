"""sd-scripts library (kohya-compatible): model loading, datasets, training core, compile support."""
