"""Context parallelism: not provided by gradpool (its names raise FeatureNotProvidedError when
used; see :mod:`hyper_parallel.core.not_provided`)."""
