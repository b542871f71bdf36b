"""One optimizer step's data: its batch, whole or streaming as groups complete (``batch``), and what
the step event reports of it (``stats``). Pure: it knows nothing of cells, the schedule or files."""
