"""The application on top of gradpool and hyper_parallel: the tiny DeepSeek-V3-shaped model
(``model``), training and its unsharded reference (``train``), one rank of ``gradpool train``
(``rank_main``) and its launching side (``job``), the YAML run config (``config``), the msrun
launcher (``launch``, ``_rank_entry``) and the command line (``cli``)."""
