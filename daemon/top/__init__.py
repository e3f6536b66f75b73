"""`councild top`: a live view of a running daemon over the status socket (main.py)."""
