"""What happens when something fails: the abort policy that keeps ranks paired when one rank
fails (``abort``), the stall inspector that names a collective that does not finish
(``stall``), and the last words a crashing process writes for the supervisor
(``last_words``).

It may import ``comm``, ``launch`` and the root modules, never MXNet.
"""
