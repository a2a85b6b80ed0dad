"""ditkv: paged-KV serving for unified AR + diffusion image models."""
__version__ = "0.1.0"
