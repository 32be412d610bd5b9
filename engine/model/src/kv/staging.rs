//! The f32 staging of a chunk not yet sealed: the open chunk a pass writes, or a chunk being
//! recomputed. It is held layer by layer, because a batched pass is done with a layer of the
//! chunks it completes as soon as that layer is sealed and attended: dropping it then keeps one
//! layer of those chunks in f32 at a time, not all of them (16 chunks of a 256-token step hold
//! 11.8 MiB of f32 on the default model at once; one layer of them 0.4 MiB).

use crate::kv::codec::ChunkShape;

/// One chunk's K/V in f32, per layer `[k|v][kv_head][token][dim]`; a layer not held is empty.
#[derive(Debug)]
pub(crate) struct Staging {
    layers: Vec<Vec<f32>>,
    /// f32 values of one layer: K and V of every KV head.
    layer_len: usize,
}

impl Staging {
    /// No layer held yet: each is allocated (zeroed) when first written.
    pub(crate) fn empty(shape: &ChunkShape) -> Staging {
        Staging {
            layers: vec![Vec::new(); shape.n_layers],
            layer_len: 2 * shape.section(),
        }
    }

    /// Layer `layer`, or `None` when it is not written yet or was released.
    pub(crate) fn layer(&self, layer: usize) -> Option<&[f32]> {
        self.layers
            .get(layer)
            .filter(|l| !l.is_empty())
            .map(Vec::as_slice)
    }

    /// Layer `layer` to write, allocated (zeroed) if it is not held.
    pub(crate) fn layer_mut(&mut self, layer: usize) -> &mut [f32] {
        let l = &mut self.layers[layer];
        if l.is_empty() {
            *l = vec![0.0; self.layer_len];
        }
        l
    }

    /// Frees layer `layer`'s f32: the pass has sealed and attended it.
    pub(crate) fn release(&mut self, layer: usize) {
        if let Some(l) = self.layers.get_mut(layer) {
            *l = Vec::new();
        }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.len() * 4).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::codec::ChunkShape;

    fn shape() -> ChunkShape {
        ChunkShape {
            tokens: 4,
            n_layers: 3,
            n_kv_heads: 2,
            head_dim: 8,
            ..ChunkShape::DENSE
        }
    }

    #[test]
    fn a_released_layer_is_gone_until_written_again() {
        let s = shape();
        let mut st = Staging::empty(&s);
        assert_eq!(st.bytes(), 0);
        assert!(st.layer(0).is_none());
        st.layer_mut(0)[3] = 1.0;
        st.layer_mut(1)[5] = 2.5;
        st.layer_mut(2);
        assert_eq!(st.bytes(), 3 * 2 * 2 * 4 * 8 * 4);
        assert_eq!(st.layer(0).map(|l| l[3]), Some(1.0));
        st.release(1);
        assert!(st.layer(1).is_none());
        assert_eq!(st.bytes(), 2 * 2 * 2 * 4 * 8 * 4);
        assert_eq!(
            st.layer_mut(1)[5],
            0.0,
            "a layer written again starts at zero"
        );
        assert_eq!(st.layer(0).map(<[f32]>::len), Some(2 * 2 * 4 * 8));
    }
}
