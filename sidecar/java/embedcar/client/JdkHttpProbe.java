package embedcar.client;

import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;

/**
 * POSTs a JSON body to the sidecar's HTTP facade with the JDK's own HttpClient, built as
 * LangChain4j's default transport builds it (langchain4j-http-client-jdk: HttpClient.newBuilder()
 * with its default version, HTTP/2, which over plain http first offers an h2c upgrade), with the
 * headers DefaultOpenAiClient sends. Prints the protocol version and status, then the body.
 * Solr's text-to-vector module calls an OpenAI-compatible endpoint this way.
 *
 * <pre>java -cp CLASSPATH embedcar.client.JdkHttpProbe URL API_KEY BODY_FILE</pre>
 */
public final class JdkHttpProbe {

    private JdkHttpProbe() {}

    public static void main(String[] args) throws Exception {
        HttpClient client = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(15)).build();
        HttpRequest request = HttpRequest.newBuilder(URI.create(args[0]))
                .timeout(Duration.ofSeconds(60))
                .header("Content-Type", "application/json")
                .header("Authorization", "Bearer " + args[1])
                .header("User-Agent", "langchain4j-openai")
                .POST(HttpRequest.BodyPublishers.ofByteArray(Files.readAllBytes(Path.of(args[2]))))
                .build();
        HttpResponse<String> response = client.send(request, HttpResponse.BodyHandlers.ofString());
        System.out.println(response.version() + " " + response.statusCode());
        System.out.println(response.body());
    }
}
