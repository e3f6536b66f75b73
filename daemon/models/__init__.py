"""Model references, downloads and inspection: what `councild model ...` and `serve --model`
use to turn "org/name[@revision]" or a folder into a model folder on disk.

Nothing here imports mlx at module level: `councild model list|inspect` stay light, and the
engine imports ``layout`` (which tensor names are an MTP head) without pulling in the Hub
client.
"""
