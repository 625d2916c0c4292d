"""One module per reproduction study; each defines ``STUDY`` (a :class:`harness.Study`)."""
