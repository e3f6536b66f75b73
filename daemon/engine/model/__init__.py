"""The model: loading and sharding a checkpoint, its MTP head, its capture and compiled forwards."""
