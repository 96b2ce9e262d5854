"""The DTensor backend: mesh, sharding plan, and one module per parallel dimension."""
