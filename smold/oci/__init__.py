"""OCI images as guest root disks: import, registry pull, layer unpacking, ext4 build and a local cache."""
