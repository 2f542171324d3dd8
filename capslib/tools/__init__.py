"""Commands (``python -m capslib.tools.<name>``); no chapter imports them. They import the book's
machinery (:mod:`capslib.book`) and the library, never the other way round."""
