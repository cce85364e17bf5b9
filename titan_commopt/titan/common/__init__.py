"""What both torchtitan lines read the same way: the meshes → R/S/T (``mesh.py``), the bundled
corpus (``corpus.py``), the console line of a log step (``console_line.py``), a run's checkpoint
settings for the resume check (``checkpoint_settings.py``)."""
