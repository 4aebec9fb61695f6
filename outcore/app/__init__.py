"""The product around the library: the ``outcore`` command and its main training job.

``cli`` parses arguments and applies the error policy; ``train`` is ``outcore train``;
``data`` the byte-level corpus and batches; ``models`` the GPT presets and the Hugging Face
folder loader; ``report`` the metrics file and PNG report.
The library never needs this package (``estimate`` looks up a preset's shape here only when
asked for one by name).
"""
