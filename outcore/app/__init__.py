"""The product around the library: the ``outcore`` command and its main training job.

``cli`` parses arguments and applies the error policy; ``train`` is ``outcore train``, with
its settings in ``job``; ``data`` the byte-level corpus and batches; ``models`` the GPT presets
and the Hugging Face folder loader; ``blocks`` which blocks checkpoint or offload their
activations; ``lora`` the job's adapters; ``report`` the metrics file and PNG report.
The library never needs this package (``estimate`` looks up a preset's shape here only when
asked for one by name).
"""
