"""dgserve's server application, installed as ``dgserve.service``: run it as ``dgserve serve`` (or
``python -m dgserve.service``)."""
