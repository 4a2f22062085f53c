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
    pub fn of<B: burn::tensor::backend::Backend>(output: O, codec: Option<Codec<O, B>>) -> Self {
        match codec {
            Some(codec) => {
                let mut words = Vec::new();
                (codec.encode)(&output, &mut words);
                Handoff::Words(words)
            }
            None => Handoff::Output(output),
        }
    }

    /// The output on rank 0's `device`.
    ///
    /// # Errors
    /// The words cannot be decoded (they came from the same type's encoder: a bug, not a user's
    /// error), or there is no codec to decode them with.
    pub fn take<B: burn::tensor::backend::Backend>(
        self,
        codec: Option<Codec<O, B>>,
        device: &B::Device,
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
    use burn::backend::NdArray;
    use burn::tensor::{Int, Tensor};
    use burn::train::ClassificationOutput;

    use super::*;

    #[test]
    fn an_output_with_a_codec_crosses_as_host_words_and_comes_back_whole() {
        let device = Default::default();
        let output = || {
            ClassificationOutput::<NdArray>::new(
                Tensor::from_floats([0.5], &device),
                Tensor::from_floats([[1.0, 2.0], [3.0, 4.0]], &device),
                Tensor::<NdArray, 1, Int>::from_ints([1, 0], &device),
            )
        };
        let codec = crate::outputs::codec::<ClassificationOutput<NdArray>, NdArray>();
        let handoff = Handoff::of(output(), codec);
        let output = output();
        assert!(matches!(handoff, Handoff::Words(_)));
        let back = handoff.take(codec, &device).unwrap();
        assert_eq!(back.output.into_data(), output.output.into_data());
        assert_eq!(back.targets.into_data(), output.targets.into_data());
        assert_eq!(back.loss.into_data(), output.loss.into_data());
        // Without a codec it is the output itself.
        let plain: Handoff<u32> = Handoff::of::<NdArray>(7, None);
        assert_eq!(plain.take::<NdArray>(None, &device), Ok(7));
    }
}
