"""The library of shipped objectives, as package data: `drpo` names objectives/drpo.dsl."""
