//! What a replica's thread hands rank 0's thread: a step's output as host data, read on the
//! thread that produced it, when its type has a codec (burn-train's outputs). On an asynchronous
//! runtime a device tensor that one thread hands another is only a handle: the work behind it
//! runs on the producer's stream (with fusion, is not even submitted), and the producer goes on
//! to its next step; rank 0's thread read such losses as garbage or zero (Burn's wgpu backend,
//! 1 to 11 steps in 93). Read where it was made, it crosses complete. An output without a codec
//! crosses as it is, after the producer's device was synchronised (the best a type burn-ddp
//! cannot read allows).

use crate::outputs::Codec;

/// One output on its way to rank 0's thread.
pub(super) enum Handoff<O> {
    /// Read on the producer's thread ([`Codec::encode`]).
    Words(Vec<u64>),
    /// As it is (no codec).
    Output(O),
}

impl<O> Handoff<O> {
    /// `output`, read here into host words when `codec` is given.
    ///
    /// # Errors
    /// A tensor of the output cannot be read from its device ([`Codec::encode`]'s message).
    pub fn of(output: O, codec: Option<Codec<O>>) -> std::result::Result<Self, String> {
        match codec {
            Some(codec) => {
                let mut words = Vec::new();
                (codec.encode)(&output, &mut words)?;
                Ok(Handoff::Words(words))
            }
            None => Ok(Handoff::Output(output)),
        }
    }

    /// The output on rank 0's `device`.
    ///
    /// # Errors
    /// The words cannot be decoded (they came from the same type's encoder: a bug, not a user's
    /// error), or there is no codec to decode them with.
    pub fn take(
        self,
        codec: Option<Codec<O>>,
        device: &burn::tensor::Device,
    ) -> std::result::Result<O, String> {
        match (self, codec) {
            (Handoff::Output(output), _) => Ok(output),
            (Handoff::Words(words), Some(codec)) => (codec.decode)(&mut words.as_slice(), device),
            (Handoff::Words(_), None) => Err("an encoded output without its codec".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Int, Tensor};
    use burn::train::ClassificationOutput;

    use super::*;

    fn read<const D: usize, K: burn::tensor::kind::Basic>(t: Tensor<D, K>) -> Vec<f32> {
        t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
    }

    #[test]
    fn an_output_with_a_codec_crosses_as_host_words_and_comes_back_whole() {
        let device = crate::replica::tests::test_device();
        let output = || ClassificationOutput {
            loss: Tensor::from_floats([0.5], &device),
            output: Tensor::from_floats([[1.0, 2.0], [3.0, 4.0]], &device),
            targets: Tensor::<1, Int>::from_ints([1, 0], &device),
        };
        let codec = crate::outputs::codec::<ClassificationOutput>();
        let handoff = Handoff::of(output(), codec).unwrap();
        let original = output();
        assert!(matches!(handoff, Handoff::Words(_)));
        let back = handoff.take(codec, &device).unwrap();
        assert_eq!(read(back.output), read(original.output));
        assert_eq!(read(back.targets), read(original.targets));
        assert_eq!(read(back.loss), read(original.loss));
        // Without a codec it is the output itself.
        let plain: Handoff<u32> = Handoff::of(7, None).unwrap();
        assert_eq!(plain.take(None, &device), Ok(7));
        // Words without their codec: an error, not a panic.
        let words = Handoff::of(output(), codec).unwrap();
        assert!(words.take(None, &device).is_err());
    }
}
