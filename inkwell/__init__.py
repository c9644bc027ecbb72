"""inkwell: LoRA fine-tuning and multi-adapter serving for the Inkling model family."""

__version__ = "0.1.0"
