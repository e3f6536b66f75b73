"""Caches: the batch's rows and ragged caches, the MTP head's history, the prefix cache in RAM and on disk."""
