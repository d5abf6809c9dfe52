//! corral-image against the real thing: Debian's distribution registry on loopback, images
//! built with umoci and pushed with skopeo, archives written by skopeo.

mod load;
mod pull;
mod support;
