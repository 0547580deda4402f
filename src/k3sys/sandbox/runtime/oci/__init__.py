"""Templates from OCI images and Dockerfiles: one builder for the CLI (and a later HTTP API).

- `unpack.py`: one layer tar unpacked safely (nothing lands outside, overlay's whiteouts);
- `layerstore.py`: layers, each unpacked once and content-addressed, and templates composed from them;
- `image.py`: OCI layouts, OCI / `docker save` archives, registry references (skopeo);
- `catalog.py`: importing an image, sealing, listing and removing templates, collecting layers;
- `steps.py`: the build description every front end produces;
- `dockerfile.py`: a Dockerfile read into build steps (E2B's parser, e2b-dockerfile-utils);
- `e2b_template.py`: E2B's template definition (the SDK's `Template()`) read into build steps;
- `context.py`: COPY / ADD sources taken from the build context, never through its links;
- `builder.py`: the steps run with a cache keyed by each step's input, RUN in a hardened sandbox.

docs/templates.md has the usage, the safety rules and the storage decision.
"""
