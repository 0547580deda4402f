"""Templates from OCI images and Dockerfiles: one builder for the CLI (and a later HTTP API).

- `unpack.py`: one layer tar unpacked safely (nothing lands outside, overlay's whiteouts);
- `layerstore.py`: layers, each unpacked once and content-addressed, and templates composed from them;
- `image.py`: OCI layouts, OCI / `docker save` archives, registry references (skopeo);
- `catalog.py`: importing an image, sealing, listing and removing templates, collecting layers;
- `dockerfile.py`: a Dockerfile read into build steps (E2B's parser, e2b-dockerfile-utils);
- `context.py`: COPY / ADD sources taken from the build context, never through its links;
- `builder.py`: the steps run with a cache keyed by each step's input, RUN in a hardened sandbox.

docs/templates.md has the usage, the safety rules and the storage decision.
"""
