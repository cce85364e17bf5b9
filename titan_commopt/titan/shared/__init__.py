"""What both torchtitan lines read the same way: the meshes → R/S/T (``mesh.py``), the bundled
corpus (``corpus.py``)."""
