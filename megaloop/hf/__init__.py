"""The exported model's own code (transformers remote code): copied into every export."""
