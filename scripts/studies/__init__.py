"""The paper reproductions, one module per study, each defining ``STUDY`` (a ``lightning_fedhet.experiments.Study``
declared with :func:`studies._repo.study`): plug-ins of the package, kept in the repository, not in the wheel."""

#: the studies in the order of the results index (the order they were added)
STUDIES = ("cafed", "upgapl", "fedstale", "fedau", "fedacs", "fedcis", "fedast")
